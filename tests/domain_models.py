"""Models shared by the domain tests (imported on every rank): a small U-Net and a small ViT."""

from __future__ import annotations

import torch
from torch import nn

H, W = 14, 10


class TinyUNet(nn.Module):
    """Strided, dilated+circular, transposed convs, GroupNorm, max pooling, bilinear upsampling, a skip."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(2, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(inplace=True))
        self.down = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.mid = nn.Sequential(nn.Conv2d(8, 8, 3, padding=2, dilation=2, padding_mode="circular"),
                                 nn.GroupNorm(4, 8), nn.SiLU())
        self.up = nn.Upsample(scale_factor=2, mode="bilinear")
        self.up_t = nn.ConvTranspose2d(8, 8, 2, stride=2)
        self.dec = nn.Conv2d(16, 2, (4, 3), padding="same")

    def forward(self, x):
        e = self.enc(x)
        m = self.mid(self.down(e) + self.pool(e))
        u = self.up(m) + self.up_t(m)
        return self.dec(torch.cat([e, u], dim=1))


class TinyViT(nn.Module):
    """Patch embedding (strided conv), token flatten, LayerNorm, global SDPA, MLP, mean-pooled head."""

    def __init__(self, dim: int = 12) -> None:
        super().__init__()
        self.embed = nn.Conv2d(2, dim, 2, stride=2)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # No key bias: its gradient is analytically zero (softmax ignores a per-query constant), so it is
        # pure rounding noise that Adam would blow up to +-lr, differently in each process.
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim)
        # The head runs on a replicated value (after global pooling): its gradient must still come out
        # right after the domain sum (each rank keeps 1/D of it).
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.head = nn.Sequential(nn.Linear(dim, 2 * dim), nn.Tanh(), nn.Linear(2 * dim, 3))

    def forward(self, x):
        t = self.embed(x).flatten(2).transpose(1, 2)  # (B, tokens, dim), tokens sharded over the domain
        h = self.norm1(t)
        t = t + torch.nn.functional.scaled_dot_product_attention(self.q(h), self.k(h), self.v(h))
        t = t + self.mlp(self.norm2(t))
        return self.head(t.mean(dim=1))  # replicated (B, 3)
