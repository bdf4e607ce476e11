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


class GridViT(nn.Module):
    """A ViT on a token grid (2-D or 3-D patches): class token, learned position embedding, a global-attention
    block (timm-style fused qkv), a neighbourhood-attention block on the grid, the tokens reshaped back to the
    grid for a conv decoder, and a head on the class token plus the mean token."""

    def __init__(self, tokens: int, nd: int = 2, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        conv = getattr(nn, f"Conv{nd}d")
        self.heads = heads
        self.embed = conv(2, dim, 2, stride=2)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.5)
        self.pos = nn.Parameter(torch.randn(1, 1 + tokens, dim) * 0.5)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.near_q, self.near_kv = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim)
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.decode = conv(dim, 1, 3, padding=1)
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        from mesh3d.domain import neighbourhood_attention

        e = self.embed(x)
        b, c, grid = e.shape[0], e.shape[1], e.shape[2:]  # on blocks, grid is this rank's block (global known)
        hd = c // self.heads
        t = e.flatten(2).transpose(1, 2)
        t = torch.cat([self.cls.expand(b, -1, -1), t], dim=1) + self.pos
        q, k, v = self.qkv(self.norm1(t)).reshape(b, -1, 3, self.heads, hd).permute(2, 0, 3, 1, 4).unbind(0)
        t = t + self.proj(torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, -1, c))
        cls, g = t[:, 0], t[:, 1:]
        h = self.norm2(g)
        q = self.near_q(h).view(b, -1, self.heads, hd).transpose(1, 2)
        k, v = self.near_kv(h).view(b, -1, 2 * self.heads, hd).transpose(1, 2).chunk(2, dim=1)
        g = g + neighbourhood_attention(q, k, v, radius=1, grid=grid).transpose(1, 2).reshape(b, -1, c)
        g = g + self.mlp(g)
        return self.decode(g.transpose(1, 2).reshape(b, c, *grid)), self.head(cls + g.mean(dim=1))
